"""Test support shared by the suite and by long runs outside it (``support.fuzz``: the hostile-input fuzzer).

The suite imports it as ``support`` (``tests`` is on pytest's ``pythonpath``).
"""
