# This file is here just to define MlpPolicy/CnnPolicy/MultiInputPolicy that work for TRPL
# (SB3's actor-critic policies, the same names as KLPPO's: the projection lives in the algorithm, not the policy).
from sb3_kl.klppo.policies import CnnPolicy, MlpPolicy, MultiInputPolicy

__all__ = ["CnnPolicy", "MlpPolicy", "MultiInputPolicy"]
