"""
Convert records folders of the old layout (one ``<algo>__<env>__lr<m>__s<seed>.json`` file per run) to the current one
(``run_records``: one ``records.jsonl`` per folder, a record per line), losslessly: every record read back from the new
file must equal its file's, one for one, before the files are removed. The committed records were converted with it
once; it is kept for records made elsewhere in the old layout::

    python benchmarks/studies/records_to_jsonl.py benchmarks/results  # every such folder under it
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]  # benchmarks/: the modules and results/ the study shares
sys.path.insert(0, str(HERE))

import run_records  # noqa: E402

#: The fields by which a file holds a run's record of the grid's kind
RECORD_FIELDS = {"algo", "env", "lr_mult", "seed", "kl_updates"}


def old_records(folder: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The folder's record files of the old layout (named for their run), in name order."""
    found = []
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and RECORD_FIELDS <= set(record) and path.stem == run_records.record_key(record):
            found.append((path, record))
    return found


def convert(folder: Path) -> int:
    """
    Append the folder's old record files to its records file, check that they read back equal, then remove them.

    :return: the number of records converted
    """
    found = old_records(folder)
    if not found:
        return 0
    if run_records.read_folder(folder):
        raise SystemExit(f"{folder} already has a {run_records.RECORDS_FILE}: convert it by hand")
    for _, record in found:
        run_records.append_record(folder, record)
    back = run_records.read_folder(folder)
    if back != [record for _, record in found]:
        (folder / run_records.RECORDS_FILE).unlink()
        raise SystemExit(f"{folder}: the records did not read back equal; nothing removed")
    for path, _ in found:
        path.unlink()
    return len(found)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path, help="a results folder: every records folder under it is converted")
    args = parser.parse_args(argv)
    folders = sorted({path.parent for path in args.root.rglob("*.json")})
    total = 0
    for folder in folders:
        n = convert(folder)
        if n:
            print(f"{folder}: {n} records")
            total += n
    print(f"{total} records converted")


if __name__ == "__main__":
    main()
