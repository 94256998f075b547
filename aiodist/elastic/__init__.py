"""Elastic-launch helpers (torch.distributed.elastic counterparts). See ``aiodist.elastic.utils``."""
