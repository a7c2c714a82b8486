"""Create a venv layered over another one: its own site-packages come first, the base venv's after.

Used by `make test-oldest`: the layer holds only the oldest supported transformers (and whatever that version
needs in other versions), while torch, the editable kvtrim and the test tools come from the base venv, so the
second venv costs one small pip install instead of a second torch.

    python .ci/overlay_venv.py BASE_VENV LAYER_VENV
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path


def site_packages(python: Path) -> str:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    base, layer = (Path(p).resolve() for p in sys.argv[1:3])
    if not (layer / "bin" / "python").exists():
        venv.EnvBuilder(with_pip=True).create(layer)
    base_site = site_packages(base / "bin" / "python")
    # addsitedir (not a bare path line) so the base venv's own .pth files (the editable kvtrim) are honoured too
    pth = Path(site_packages(layer / "bin" / "python")) / "zz-base-venv.pth"
    pth.write_text(f"import site; site.addsitedir({base_site!r})\n")
    print(f"{layer}: layered over {base_site}")


if __name__ == "__main__":
    main()
