"""Serving (gRPC Recommend, KServe v2, HTTP, batching, model repository): not built yet."""
