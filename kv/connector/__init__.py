"""The KV-connector seam: hooks through which a plugin moves KV blocks between the paged
pool and somewhere else (a host or disk tier, another engine), with vLLM
`KVConnectorBase_V1`'s roles. The specs are here (`hookspecs`), the per-step result the
worker reports (`KVConnectorOutput`) beside them; the kernel registers the specs and the
reference scheduler and the model runner call them. Nothing here touches tensors or the
kernel's request type: hooks receive the caller's objects."""

from tandem.kv.connector.hookspecs import KVConnectorSchedulerSpecs, KVConnectorWorkerSpecs
from tandem.kv.connector.output import KVConnectorOutput

#: vLLM connector class names with a bundled tandem equivalent (`kv_transfer.kv_connector`).
KV_CONNECTOR_ALIASES = {"OffloadingConnector": "kv-offload", "MultiConnector": "kv-multi"}

__all__ = [
    "KV_CONNECTOR_ALIASES",
    "KVConnectorOutput",
    "KVConnectorSchedulerSpecs",
    "KVConnectorWorkerSpecs",
]
