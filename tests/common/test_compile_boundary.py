"""``common/compile_boundary.py``: servers start without importing ``torch._dynamo``, and a
function marked eager still runs eagerly inside a compiled graph (each case in a fresh
interpreter: the lazy path exists only while dynamo is not loaded)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.multiproc


def python(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_servers_and_the_cli_start_without_loading_dynamo():
    said = python(
        """
        import sys
        import recserve.cli, serving.app.main, serving.sharding.router
        import serving.sharding.shard_server, sharded_tables.remote.server, retrieval.training.train
        print("torch._dynamo" in sys.modules)
        """
    )
    assert said == "False"


def test_a_function_marked_before_dynamo_loads_runs_eagerly_in_a_compiled_graph():
    said = python(
        """
        import torch
        from common.compile_boundary import eager_under_compile

        seen = []

        @eager_under_compile
        def data_dependent(x):
            seen.append(torch.compiler.is_compiling())
            return x * 2 if float(x.sum()) > 0 else x - 1  # a branch on data

        def f(x):
            return data_dependent(x + 1) + 1

        x = torch.arange(4.0)
        compiled = torch.compile(f, backend="eager")
        assert torch.equal(compiled(x), f(x)) and torch.equal(compiled(-x - 9), f(-x - 9))
        explained = torch._dynamo.explain(f)(x)
        print(seen.count(True), explained.graph_break_count >= 1)
        """
    )
    assert said == "0 True"
