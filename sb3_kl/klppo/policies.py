# This file is here just to define MlpPolicy/CnnPolicy/MultiInputPolicy
# that work for KLPPO, ClipKLPPO and KLTRPO: SB3's actor-critic policies, unchanged.
from stable_baselines3.common.policies import ActorCriticCnnPolicy, ActorCriticPolicy, MultiInputActorCriticPolicy

MlpPolicy = ActorCriticPolicy
CnnPolicy = ActorCriticCnnPolicy
MultiInputPolicy = MultiInputActorCriticPolicy
