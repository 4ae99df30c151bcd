"""The worker's on-disk copy of transformers' model table (mlxrt.worker.hf_index): same table, read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# A process as the worker starts: the table remembered, then transformers and a tokenizer loaded.
PROBE = """
import json, sys
from mlxrt.worker.hf_index import remember_transformers_index
remember_transformers_index()
import transformers
from transformers import AutoTokenizer
from transformers.utils import import_utils
names = sorted(dir(transformers)) + sorted(dir(transformers.models))
print(json.dumps({"names": names, "scans": import_utils.create_import_structure_from_path.cache_info().misses,
                  "ids": AutoTokenizer.from_pretrained(sys.argv[1]).encode("hello there")}))
"""


def probe(tiny_model: str, cache, **env: str) -> dict:
    """What PROBE saw, in a fresh process whose cache directory is `cache`."""
    proc = subprocess.run([sys.executable, "-c", PROBE, tiny_model], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "XDG_CACHE_HOME": str(cache), **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_table_from_disk_is_transformers_own(tiny_model, tmp_path):
    """The first process builds the table with transformers' own code and stores it; the next reads it
    without scanning a file and sees the same names and tokenizer; a corrupt copy is rebuilt, not trusted."""
    first = probe(tiny_model, tmp_path)
    stored = sorted((tmp_path / "mlxrt" / "transformers-index").iterdir())
    second = probe(tiny_model, tmp_path)
    assert first["scans"] > 0 and second["scans"] == 0 and stored
    assert first["names"] == second["names"] and first["ids"] == second["ids"]
    assert "AutoTokenizer" in first["names"] and "LlamaConfig" in first["names"]
    for f in stored:
        f.write_bytes(b"not a table")
    again = probe(tiny_model, tmp_path)
    assert again["scans"] > 0 and again["names"] == first["names"]
    assert all(f.read_bytes() != b"not a table" for f in stored)


def test_off_leaves_the_cache_alone(tiny_model, tmp_path):
    """MLXRT_TRANSFORMERS_INDEX=0: transformers scans as it always did and nothing is written."""
    own = probe(tiny_model, tmp_path, MLXRT_TRANSFORMERS_INDEX="0")
    assert own["scans"] > 0 and "AutoTokenizer" in own["names"] and not (tmp_path / "mlxrt").exists()
