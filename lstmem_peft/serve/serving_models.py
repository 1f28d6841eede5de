"""``GET /v1/models`` and ``GET /v1/models/{model}``: the one served model (:class:`ServingModels`)."""

from __future__ import annotations

from .protocol import ModelCard, ModelList
from .serving_base import ServingBase


class ServingModels(ServingBase):
    """The models endpoints: this server serves one model, under ``loaded.name``."""

    def card(self) -> ModelCard:
        return ModelCard(id=self.loaded.name)

    def list_models(self) -> ModelList:
        """``GET /v1/models``."""
        return ModelList(data=[self.card()])

    def retrieve(self, model: str) -> ModelCard:
        """``GET /v1/models/{model}``: the card, or 404 naming the served model."""
        self.check_model(model)
        return self.card()
