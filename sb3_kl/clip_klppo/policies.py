# This file is here just to define MlpPolicy/CnnPolicy/MultiInputPolicy that work for ClipKLPPO
# (SB3's actor-critic policies, the same names as KLPPO's).
from sb3_kl.klppo.policies import CnnPolicy, MlpPolicy, MultiInputPolicy

__all__ = ["CnnPolicy", "MlpPolicy", "MultiInputPolicy"]
