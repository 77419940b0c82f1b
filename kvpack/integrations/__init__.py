"""kvpack inside other engines: the kvtc serde for LMCache (``lmcache_serde.py``, needs ``pip install
'kvpack[lmcache]'``) and the LMCache server launcher that registers it (``lmcache_server.py``)."""
