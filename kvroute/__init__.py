"""kvroute: the command line, the default model and what every process shares (config, logs)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvroute")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+source"
