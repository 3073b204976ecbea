from sb3_kl.clip_klppo.clip_klppo import ClipKLPPO
from sb3_kl.clip_klppo.policies import CnnPolicy, MlpPolicy, MultiInputPolicy

__all__ = ["ClipKLPPO", "CnnPolicy", "MlpPolicy", "MultiInputPolicy"]
