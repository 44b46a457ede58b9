"""Float tables -> tiered, quantized tables: a transform that returns (model, plan), as
TorchRec's ``quantize_embeddings`` does.

Example::

    tiered, remote_rows = tier_model(model, Budgets(device=0, host=64 << 20), dtype=DType.INT8)
    tiered.config.table_plan   # the placement, saved with the model
    # remote_rows: {table: packed rows} for tables the plan put on embedding servers
    # ({table: (keys, packed rows)} for hashed ones)
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from retrieval.model import RetrievalModel, table_specs
from sharded_tables.export import RemoteRows
from sharded_tables.planner import Budgets, PlacementPlan, plan
from sharded_tables.specs import DType
from sharded_tables.tiered import RemoteFetcher


def float_tables(model: RetrievalModel) -> dict[str, torch.Tensor]:
    """``{table: float rows [rows, D]}`` of a model with plain tables (``ValueError`` when
    they are already tiered)."""
    return model.tables.float_weights()


def tier_model(
    model: RetrievalModel,
    budgets: Budgets | None = None,
    dtype: DType = DType.INT8,
    allowed: tuple[DType, ...] = (),
    placement: PlacementPlan | None = None,
    remote: RemoteFetcher | None = None,
    device: torch.device | str = "cpu",
) -> tuple[RetrievalModel, RemoteRows]:
    """A copy of ``model`` whose tables are placed by ``placement`` (or planned from ``budgets``).

    Towers, head and index are shared copies of the original's. Returns the new model and the
    packed rows of remote tables (they belong in the embedding servers' shard folders). Hashed
    tables take every learned row (``keyed_rows``), packed in the plan's dtype.
    """
    keyed = model.tables.keyed_rows()
    if placement is None:
        if budgets is None:
            raise ValueError("give budgets (to plan) or a placement plan")
        specs = [  # a hashed table is as large as the rows it learned
            dataclasses.replace(s, rows=max(1, len(keyed[s.name][0]))) if s.name in keyed else s
            for s in table_specs(model.config, dtype, allowed)
        ]
        if torch.device(device).type == "cuda" and not budgets.has_gpu:
            budgets = dataclasses.replace(budgets, has_gpu=True)  # host tables' caches in HBM
        placement = plan(specs, budgets)
    cfg = copy.deepcopy(model.config)
    cfg.table_plan = placement.to_dict()
    tiered = RetrievalModel(cfg, remote=remote, table_device=device)
    own = {k: v for k, v in model.state_dict().items() if not k.startswith(("tables.", "index."))}
    tiered.load_state_dict(own, strict=False)
    tiered.index = copy.deepcopy(model.index)
    tiered.id_maps = model.id_maps
    remote_rows: RemoteRows = dict(tiered.tables.load_float(float_tables(model)))
    if keyed:
        remote_rows.update(tiered.tables.load_keyed(keyed))
    return tiered.eval(), remote_rows
