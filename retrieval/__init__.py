"""The retrieval model: features -> tables -> tower -> index -> filter -> score -> top-K."""
