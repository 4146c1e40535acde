"""Import-only stand-in for torchvision.transforms.v2: see torchvision/__init__.py."""

from torchvision import missing_names
from torchvision.transforms.v2 import functional  # noqa: F401  (as in the real package)

__getattr__ = missing_names(__name__)
