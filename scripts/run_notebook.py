"""Execute a notebook headless with nbclient, print its text outputs, save the result.

Used by `make demo`. The executed copy (widgets' state included) goes to artifacts/.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def main(path: str) -> None:
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=600, kernel_name="python3", store_widget_state=True,
                            resources={"metadata": {"path": str(Path(path).parent)}})
    client.execute()
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        print(f"\n>>> {cell.source.splitlines()[0] if cell.source else ''}")
        for output in cell.get("outputs", []):
            text = output.get("text") or output.get("data", {}).get("text/plain", "")
            if text:
                print(text.rstrip("\n"))
    out = Path("artifacts") / Path(path).name
    out.parent.mkdir(exist_ok=True)
    nbformat.write(notebook, out)
    print(f"\nexecuted notebook saved to {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "notebooks/quickstart.ipynb")
