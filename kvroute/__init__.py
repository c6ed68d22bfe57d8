"""kvroute: what every process shares (config, logs, the default model, the vocabulary, keys, the rules of a slot)
and the Python client of the protocol. The commands are in commands/, the layer above."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvroute")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+source"
