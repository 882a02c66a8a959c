"""Runs vLLM's real ``DPCoordinatorProc.run_coordinator`` in this process.

Executed by :func:`tests.vllm_reference.start_vllm_coordinator` with an import root on
``PYTHONPATH`` (vLLM's source plus stand-ins); argv[1] is a JSON object of
``run_coordinator``'s keyword arguments, where an address absent or null is chosen by
vLLM's own ``get_engine_client_zmq_addr(local_only=True, ...)`` (a fresh IPC path) and
other absent arguments take vLLM's defaults.

The ``zmq_addr_pipe`` vLLM normally hands it is a ``multiprocessing`` pipe end; here it is
a stand-in whose ``send`` prints the bound addresses as one JSON line on stdout, prefixed
with ``ADDRESSES_MARKER``. SIGINT stops it cleanly (vLLM catches KeyboardInterrupt);
SIGTERM ends it as vLLM's own ``shutdown`` does.
"""

import json
import sys

ADDRESSES_MARKER = "VLLM_REFERENCE_ADDRESSES "


class AddressPipe:
    """Stands in for the ``zmq_addr_pipe`` end: ``send`` and ``close`` only."""

    def send(self, addresses: tuple[str, str, str]) -> None:
        sys.stdout.write(ADDRESSES_MARKER + json.dumps(list(addresses)) + "\n")
        sys.stdout.flush()

    def close(self) -> None:
        pass


def main() -> None:
    from vllm.v1.engine.coordinator import DPCoordinatorProc
    from vllm.v1.utils import get_engine_client_zmq_addr

    kwargs = json.loads(sys.argv[1])
    for name in ("front_publish_address", "back_output_address", "back_publish_address"):
        if kwargs.get(name) is None:
            kwargs[name] = get_engine_client_zmq_addr(local_only=True, host="127.0.0.1")
    DPCoordinatorProc.run_coordinator(zmq_addr_pipe=AddressPipe(), **kwargs)


if __name__ == "__main__":
    main()
