"""torch.distributed.algorithms.model_averaging's path (its ``utils``): ``aiodist.model_averaging``."""
