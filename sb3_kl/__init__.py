import os

from sb3_kl.callbacks import KLAdaptiveLRCallback, KLAlarmCallback, KLMonitorCallback, VarianceFloorCallback
from sb3_kl.clip_klppo import ClipKLPPO
from sb3_kl.common.controllers import AdaptiveKLController, FixedKLController, KLController, ProportionalKLController
from sb3_kl.common.kl import KLSettings
from sb3_kl.klppo import KLPPO
from sb3_kl.kltrpo import KLTRPO
from sb3_kl.ppo_mask import MaskableKLPPO
from sb3_kl.ppo_recurrent import RecurrentKLPPO
from sb3_kl.trpl import TRPL

# Read version from file
version_file = os.path.join(os.path.dirname(__file__), "version.txt")
with open(version_file) as file_handler:
    __version__ = file_handler.read().strip()

__all__ = [
    "KLPPO",
    "KLTRPO",
    "TRPL",
    "AdaptiveKLController",
    "ClipKLPPO",
    "FixedKLController",
    "KLAdaptiveLRCallback",
    "KLAlarmCallback",
    "KLController",
    "KLMonitorCallback",
    "KLSettings",
    "MaskableKLPPO",
    "ProportionalKLController",
    "RecurrentKLPPO",
    "VarianceFloorCallback",
]
