"""OpenRLHF's helper modules for files written against its package, served when it is not installed.

``namespace`` installs the ``openrlhf`` modules treadle provides (an import hook, in place when a
reward file is loaded) and refuses every other ``openrlhf`` import by name; ``math_utils`` and
``logging_utils`` are what it serves. Importing this package imports none of them.
"""
