"""placeholder"""
from ._errors import BackendUnavailable


class CupyBackend:
    def __init__(self, **kw):
        raise BackendUnavailable("not yet")
