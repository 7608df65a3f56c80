"""The tensor vocabulary both sides share: stored-bit views, order-preserving patterns, the
records of canonical coordinates (specs, encodings, items, spans), fingerprints of stored bits
and the bounded worker pool.  The trainer side (:mod:`dcr.delta`), the wire codec
(:mod:`dcr.wire`) and the apply path (:mod:`dcr.apply`) all import from here; nothing here
imports them."""
