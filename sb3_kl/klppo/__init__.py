from sb3_kl.klppo.klppo import KLPPO
from sb3_kl.klppo.policies import CnnPolicy, MlpPolicy, MultiInputPolicy

__all__ = ["KLPPO", "CnnPolicy", "MlpPolicy", "MultiInputPolicy"]
