"""Embedding tables behind one call: ``features -> pooled embeddings``.

Today the tables are plain in-process ``nn.EmbeddingBag`` modules (:class:`EmbeddingCollection`).
Tiered, quantized tables (device / host / remote embedding servers) are not built yet; they will
sit behind this same call shape.
"""

from sharded_tables.collection import EmbeddingCollection, TableConfig

__all__ = ["EmbeddingCollection", "TableConfig"]
