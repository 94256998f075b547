"""torch.distributed.algorithms.model_averaging.utils' path: the functions of ``aiodist.model_averaging``."""

from aiodist.model_averaging import average_parameters, average_parameters_or_parameter_groups, get_params_to_average

__all__ = ["average_parameters", "average_parameters_or_parameter_groups", "get_params_to_average"]
