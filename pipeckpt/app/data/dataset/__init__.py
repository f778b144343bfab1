"""The user's own dataset (``data=dataset``): files read by ``datasets``, rows rendered and masked
(:mod:`.examples`, :mod:`.templates`), packed (:mod:`.packing`), drawn resumably (:mod:`.resumable`)."""

from pipeckpt.app.data.dataset.module import DatasetDataModule

__all__ = ["DatasetDataModule"]
