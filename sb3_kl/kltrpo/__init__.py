from sb3_kl.kltrpo.kltrpo import KLTRPO
from sb3_kl.kltrpo.policies import CnnPolicy, MlpPolicy, MultiInputPolicy

__all__ = ["KLTRPO", "CnnPolicy", "MlpPolicy", "MultiInputPolicy"]
