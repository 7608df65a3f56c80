"""The object-storage transport (paper §7.1 "Object storage", App. B "Transports", Fig. 7 left).

Owners upload each payload once, as one object under a per-attempt prefix, and list it in the
attempt's manifest; rollout nodes list the manifest and fetch every payload listed for their
receivers with a bounded number of concurrent GETs.  Storage decouples the two sides: a send
never waits for a receiver, and one stored copy serves every rollout node (each download
crosses the cluster boundary, so V_cross grows with the number of nodes).  A new store is one
subclass of :class:`ObjectBackend` (whole-object put, get, list, delete); the S3 and
directory backends live in :mod:`dcr.adapters.transport.s3` and
:mod:`dcr.adapters.transport.directory`.

The parts, one module each:

* :mod:`~dcr.adapters.transport.objstore.layout`: what lives where under the backend's root
  (payload objects, manifest entries, tombstones);
* :mod:`~dcr.adapters.transport.objstore.backend`: the store's primitives
  (:class:`ObjectBackend`);
* :mod:`~dcr.adapters.transport.objstore.config`: the settings (:class:`ObjectStoreConfig`);
* :mod:`~dcr.adapters.transport.objstore.storage`: storage operations with retries, and the
  counters of :class:`FetchStats`;
* :mod:`~dcr.adapters.transport.objstore.sender`: the owner side -- uploads, manifest entries,
  tombstones, stopping across processes and cleanup (App. B.2);
* :mod:`~dcr.adapters.transport.objstore.fetcher`: the receiver side -- a node's polling and
  fetch scheduling, and the arrival check (App. B.1);
* :mod:`~dcr.adapters.transport.objstore.transport`: :class:`ObjectStoreTransport`, composing
  them.
"""

from dcr.adapters.transport.objstore.backend import ObjectBackend, ObjectInfo
from dcr.adapters.transport.objstore.config import ObjectStoreConfig, fleet_settings
from dcr.adapters.transport.objstore.layout import (
    decode_segment,
    encode_segment,
    manifest_key,
    payload_key,
    tombstone_key,
)
from dcr.adapters.transport.objstore.storage import FetchStats
from dcr.adapters.transport.objstore.transport import ObjectStoreTransport

__all__ = [
    "FetchStats",
    "ObjectBackend",
    "ObjectInfo",
    "ObjectStoreConfig",
    "ObjectStoreTransport",
    "decode_segment",
    "encode_segment",
    "fleet_settings",
    "manifest_key",
    "payload_key",
    "tombstone_key",
]
