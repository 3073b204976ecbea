# This file is here just to define MlpPolicy/CnnPolicy/MultiInputPolicy that work for MaskableKLPPO:
# sb3-contrib's maskable actor-critic policies (MaskablePPO's), unchanged.
from sb3_contrib.ppo_mask.policies import CnnPolicy, MlpPolicy, MultiInputPolicy

__all__ = ["CnnPolicy", "MlpPolicy", "MultiInputPolicy"]
