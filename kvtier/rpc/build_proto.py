"""Regenerate the gRPC modules from kvtier.proto: ``python -m kvtier.rpc.build_proto``.

The generated ``kvtier_pb2.py`` / ``kvtier_pb2_grpc.py`` are committed, so a checkout works
without grpcio-tools; the Docker build reruns this so the stubs match the protobuf and grpcio
runtimes installed in the image (generated code refuses a runtime older than its generator).
The proto is compiled with the repository root on the include path, so the stubs import each
other as ``kvtier.rpc.kvtier_pb2``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvtier.errors import ConfigError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PROTO = HERE / "kvtier.proto"


def build() -> list[Path]:
    try:
        from grpc_tools import protoc
    except ModuleNotFoundError:
        raise ConfigError("grpcio-tools is not installed: `pip install grpcio-tools` to regenerate the stubs") from None
    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    rel = PROTO.relative_to(ROOT)
    rc = protoc.main([
        "grpc_tools.protoc", f"-I{ROOT}", f"-I{well_known}",
        f"--python_out={ROOT}", f"--grpc_python_out={ROOT}", str(rel),
    ])
    if rc != 0:
        raise ConfigError(f"protoc failed on {rel} (exit {rc})")
    return [HERE / "kvtier_pb2.py", HERE / "kvtier_pb2_grpc.py"]


def main() -> int:
    for p in build():
        print(p.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
