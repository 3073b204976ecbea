# This file is here just to define MlpLstmPolicy/CnnLstmPolicy/MultiInputLstmPolicy
# that work for RecurrentKLPPO: sb3-contrib's recurrent actor-critic policies, unchanged.
from sb3_contrib.common.recurrent.policies import (
    RecurrentActorCriticCnnPolicy,
    RecurrentActorCriticPolicy,
    RecurrentMultiInputActorCriticPolicy,
)

MlpLstmPolicy = RecurrentActorCriticPolicy
CnnLstmPolicy = RecurrentActorCriticCnnPolicy
MultiInputLstmPolicy = RecurrentMultiInputActorCriticPolicy
