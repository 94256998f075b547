"""The training layer, above c10d (torch's ``torch.nn`` namespace): ``aiodist.nn.parallel``."""
