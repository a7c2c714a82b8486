"""Compare the vLLM code kvtrim's plugin wraps or relies on (``kvtrim.vllm.patch_surface``) between two vLLMs.

    PYTHONPATH=src python tools/vllm_patch_surface.py OLD NEW [--diff]

OLD and NEW are each a wheel (``vllm-0.33.0-….whl``, read in place: ``pip download --no-deps vllm==0.33.0``), a
``site-packages`` folder or an unpacked wheel (a folder holding ``vllm/``), or the ``vllm`` package folder itself.
Nothing is installed or imported. Prints one line per entry (``same`` / ``CHANGED`` / ``missing``), with
``--diff`` the unified diff of each changed definition, and exits 1 when any entry is not ``same``.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import zipfile
from pathlib import Path

from kvtrim.vllm.patch_surface import PATCH_SURFACE, compare_definition, definition_text


def source_reader(location: Path):
    """A function ``path inside the vllm package -> source text or None`` for a wheel or a folder."""
    if location.is_file() and location.suffix == ".whl":
        archive = zipfile.ZipFile(location)
        names = set(archive.namelist())

        def read_wheel(path: str) -> str | None:
            name = f"vllm/{path}"
            return archive.read(name).decode() if name in names else None

        return read_wheel
    root = location if (location / "__init__.py").is_file() and location.name == "vllm" else location / "vllm"
    if not (root / "__init__.py").is_file():
        raise SystemExit(f"{location}: neither a wheel nor a folder holding the vllm package")

    def read_folder(path: str) -> str | None:
        file = root / path
        return file.read_text() if file.is_file() else None

    return read_folder


def version_of(location: Path) -> str:
    read = source_reader(location)
    match = re.search(r"^__version__\b.*=\s*['\"]([^'\"]+)['\"]", read("_version.py") or "", re.MULTILINE)
    return match.group(1) if match else "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--diff", action="store_true", help="print the unified diff of each changed definition")
    args = parser.parse_args(argv)
    read_old, read_new = source_reader(args.old), source_reader(args.new)
    print(f"old: vllm {version_of(args.old)} ({args.old})\nnew: vllm {version_of(args.new)} ({args.new})")
    differing = 0
    for entry in PATCH_SURFACE:
        old, new = read_old(entry.path), read_new(entry.path)
        verdict = compare_definition(old, new, entry.qualname)
        differing += verdict != "same"
        print(f"{verdict if verdict != 'changed' else 'CHANGED':8} {entry.path}:{entry.qualname}  ({entry.why})")
        if verdict == "changed" and args.diff:
            a = definition_text(old, entry.qualname).splitlines()
            b = definition_text(new, entry.qualname).splitlines()
            sys.stdout.writelines(line + "\n" for line in difflib.unified_diff(a, b, "old", "new", lineterm="", n=1))
    print(f"{len(PATCH_SURFACE) - differing} of {len(PATCH_SURFACE)} definitions unchanged")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
