from sb3_kl.trpl.policies import CnnPolicy, MlpPolicy, MultiInputPolicy
from sb3_kl.trpl.trpl import TRPL

__all__ = ["TRPL", "CnnPolicy", "MlpPolicy", "MultiInputPolicy"]
