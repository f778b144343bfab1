"""A stage and the partition into stages: one stage under its checkpoint mode, balance and
placement, deferred batch norm, gradients set aside."""
