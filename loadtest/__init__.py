"""Load tests: the request mix (``workload``), the model's request shape (``shape``) and the
locust users (``locustfile.py``, run by ``recserve test load``)."""
