from sb3_kl.ppo_recurrent.policies import CnnLstmPolicy, MlpLstmPolicy, MultiInputLstmPolicy
from sb3_kl.ppo_recurrent.ppo_recurrent import RecurrentKLPPO

__all__ = ["CnnLstmPolicy", "MlpLstmPolicy", "MultiInputLstmPolicy", "RecurrentKLPPO"]
