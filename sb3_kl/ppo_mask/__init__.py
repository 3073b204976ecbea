from sb3_kl.ppo_mask.policies import CnnPolicy, MlpPolicy, MultiInputPolicy
from sb3_kl.ppo_mask.ppo_mask import MaskableKLPPO

__all__ = ["CnnPolicy", "MaskableKLPPO", "MlpPolicy", "MultiInputPolicy"]
