"""
Reading a saved model's zip before SB3 loads it: a corrupt file is reported in one sentence naming it, and a model
saved by a stock algorithm (SB3's ``PPO``/``A2C``, sb3-contrib's ``TRPO``, ``MaskablePPO``, ``RecurrentPPO``) is
recognised so that the sb3-kl algorithms can load it with a fresh KL state.
"""

import io
import json
import pathlib
import zipfile
import zlib
from typing import Any

from stable_baselines3.common.save_util import open_path

#: Modules of the stock rollout buffers as a saved model's data records them (SB3's ``RolloutBuffer`` and
#: ``DictRolloutBuffer``, sb3-contrib's maskable and recurrent ones), which do not store the rollout distribution
STOCK_BUFFER_MODULES = (
    "stable_baselines3.common.buffers",
    "sb3_contrib.common.maskable.buffers",
    "sb3_contrib.common.recurrent.buffers",
)


#: The entry of a saved model's data that names the sb3-kl class that saved it, as ``module:qualname``
SAVED_BY_KEY = "_saved_by_class"


#: The first bytes of every zip file (of each of its records: a truncated zip still starts with them)
ZIP_SIGNATURE = b"PK"


def read_saved_data(path: str | pathlib.Path | io.BufferedIOBase) -> dict[str, Any]:
    """
    The ``data`` entry of a model zip saved by SB3 (or a library built on it), as JSON: nothing is unpickled.

    :param path: Path of the zip (``.zip`` may be left out, as with SB3's ``load``) or an open binary file, which is
        left at the position it had
    :raises FileNotFoundError: if the file does not exist
    :raises ValueError: (one sentence naming the file) if it is not a zip (SB3's message), a truncated or corrupt zip,
        has no ``data`` entry or its JSON is corrupt
    :return: the JSON object, one entry per saved attribute
    """
    file = open_path(path, "r", verbose=0, suffix="zip")
    name = getattr(file, "name", None) or str(path)
    position = file.tell()
    try:
        with zipfile.ZipFile(file) as archive:
            damaged = archive.testzip()  # the first entry whose checksum fails
            if damaged is not None:
                raise zipfile.BadZipFile(f"its entry {damaged!r} fails its checksum")
            if "data" not in archive.namelist():
                raise ValueError(f"{name} has no 'data' entry: it is not a model saved by Stable-Baselines3 or sb3-kl.")
            text = archive.read("data").decode("utf-8")
        data = json.loads(text)
    except (zipfile.BadZipFile, EOFError, zlib.error) as error:
        file.seek(position)
        if not file.read(2) == ZIP_SIGNATURE:  # SB3's own wording (its tests match it)
            raise ValueError(f"Error: the file {name} wasn't a zip-file") from None
        detail = "" if str(error) == "File is not a zip file" else f" ({error})"  # zipfile's words for a cut-off end
        raise ValueError(f"{name} is a truncated or corrupt zip file{detail}: save or copy the model again.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{name} is a corrupt model zip: its 'data' entry is not valid JSON ({error}); use another copy of the model."
        ) from None
    finally:
        if isinstance(path, (str, pathlib.Path)):
            file.close()
        else:
            file.seek(position)
    if not isinstance(data, dict):
        raise ValueError(f"{name} is a corrupt model zip: its 'data' entry is not a JSON object.")
    return data


def saved_without_kl_state(data: dict[str, Any]) -> bool:
    """Whether a saved model's data comes from an algorithm without sb3-kl's KL state (e.g. SB3's PPO)."""
    return "kl_controller" not in data


def saved_with_sb3_buffer(data: dict[str, Any]) -> bool:
    """
    Whether the saved ``rollout_buffer_class`` is a stock buffer of SB3 or sb3-contrib (which do not store the rollout
    distribution).
    """
    saved = data.get("rollout_buffer_class")
    return isinstance(saved, dict) and saved.get("__module__") in STOCK_BUFFER_MODULES


def guess_stock_algorithm(data: dict[str, Any]) -> str:
    """The stock algorithm that most likely saved ``data`` (for messages only)."""
    policy_class = data.get("policy_class")
    policy_module = policy_class.get("__module__", "") if isinstance(policy_class, dict) else ""
    if policy_module.startswith("sb3_contrib.common.recurrent"):
        return "RecurrentPPO"
    if policy_module.startswith("sb3_contrib.common.maskable"):
        return "MaskablePPO"
    if "cg_max_steps" in data:
        return "TRPO"
    if "clip_range" in data:
        return "PPO"
    if "n_epochs" not in data and "normalize_advantage" in data:
        return "A2C"
    return "a stock on-policy algorithm"


def saved_kl_algorithm(data: dict[str, Any]) -> tuple[str | None, str]:
    """
    The sb3-kl class that saved ``data`` (a zip with a KL state), as ``module:qualname``.

    :return: the class recorded in the data (None in zips saved before the record), and the family's class guessed
        from the entries only one family saves (TRPL's ``projection``, KLTRPO's ``cg_max_steps``; else KLPPO)
    """
    recorded = data.get(SAVED_BY_KEY)
    if "projection" in data and "mean_bound" in data:
        guessed = "sb3_kl.trpl.trpl:TRPL"
    elif "cg_max_steps" in data:
        guessed = "sb3_kl.kltrpo.kltrpo:KLTRPO"
    else:
        guessed = "sb3_kl.klppo.klppo:KLPPO"
    return (recorded if isinstance(recorded, str) else None), guessed
