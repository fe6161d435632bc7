"""Every request handler; importing this package registers them all in ``HANDLERS``."""
from . import admin, api_versions, metadata  # noqa: F401  (broker core)
from . import fetch, offsets_list, produce, producers, records_admin  # noqa: F401  (datapath)
from . import groups  # noqa: F401  (group coordinator)
from . import transactions  # noqa: F401  (transaction coordinator)
from .registry import HANDLERS, RequestContext, handler

__all__ = ["HANDLERS", "RequestContext", "handler"]
