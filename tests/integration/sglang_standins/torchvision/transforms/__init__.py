"""Import-only stand-in for torchvision.transforms: see torchvision/__init__.py."""

from torchvision import missing_names
from torchvision.transforms import functional, v2  # noqa: F401  (as in the real package)
from torchvision.transforms.functional import InterpolationMode  # noqa: F401

__getattr__ = missing_names(__name__)
