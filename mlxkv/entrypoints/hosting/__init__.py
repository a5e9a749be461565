"""Serving several models from one server: the catalogue of what may be served (`catalogue`), what
the checkpoints say before they are loaded (`checkpoints`), the model host that loads them on
demand and lets idle ones go within one memory budget (`host`), and how a listed model is loaded
into an engine (`loading`)."""

from .catalogue import Catalogue, ListedModel, catalogue_of, read_models_file
from .checkpoints import CheckpointFacts, facts_of
from .host import Loaded, ModelHost, Resident

__all__ = [
    "Catalogue",
    "CheckpointFacts",
    "ListedModel",
    "Loaded",
    "ModelHost",
    "Resident",
    "catalogue_of",
    "facts_of",
    "read_models_file",
]
