# Two commands set everything up on a fresh machine:
#   make demo   creates .venv, fetches MovieLens 100k, trains, builds the index, prints recommendations
#   make test   creates .venv if missing, fetches the data, runs the test suite
#   (make test-fast: the same without the slow and multi-process tests)
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ML100K := data/ml-100k/ml-100k.inter

.PHONY: demo test test-fast venv data lint bench clean
demo: $(STAMP) $(ML100K)
	$(BIN)/recserve demo

test: $(STAMP) $(ML100K)
	$(BIN)/python -m pytest -q

# The fast tier (~2 min on 2 busy cores): no test that starts a process or takes over ~3 s, on
# both cores (pytest-xdist, a file to a worker). The whole suite stays serial: its fault tests'
# deadlines are set for one busy host, not two workers' worth of load (the journal, verify49).
test-fast: $(STAMP) $(ML100K)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow and not multiproc"

venv: $(STAMP)
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -c constraints.txt torchrec==1.8.0
	$(BIN)/recserve kernels
	touch $(STAMP)

data: $(ML100K)
$(ML100K): | $(STAMP)
	$(BIN)/recserve data movielens --out data/ml-100k

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy && $(BIN)/lint-imports --no-logo

bench: $(STAMP)
	$(BIN)/python bench/ann.py

clean:
	rm -rf $(VENV) data runs

.PHONY: proto
# Regenerates the gRPC modules (embedding server, Recommend, document shard, admin) from their .proto files.
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. sharded_tables/remote/embedding.proto
	for f in sharded_tables/remote/embedding_pb2.py sharded_tables/remote/embedding_pb2.pyi sharded_tables/remote/embedding_pb2_grpc.py; do sed -i '1i # ruff: noqa\n# fmt: off' $$f; done
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. serving/protos/recommend.proto
	for f in serving/protos/recommend_pb2.py serving/protos/recommend_pb2.pyi serving/protos/recommend_pb2_grpc.py; do sed -i '1i # ruff: noqa\n# fmt: off' $$f; done
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. serving/protos/shard.proto
	for f in serving/protos/shard_pb2.py serving/protos/shard_pb2.pyi serving/protos/shard_pb2_grpc.py; do sed -i '1i # ruff: noqa\n# fmt: off' $$f; done
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. serving/protos/admin.proto
	for f in serving/protos/admin_pb2.py serving/protos/admin_pb2.pyi serving/protos/admin_pb2_grpc.py; do sed -i '1i # ruff: noqa\n# fmt: off' $$f; done
