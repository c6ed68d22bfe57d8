"""kvroute: the Python client of the protocol (client.py names it all: sync_client.py, async_client.py, what both send
in requests.py, the router's errors in errors.py; direct.py reads a job's output straight from its worker) and the
package's version. What every process shares is in common/, the layer below; the commands are in commands/."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvroute")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+source"
