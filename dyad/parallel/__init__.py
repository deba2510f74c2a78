"""Parallelism applied from outside to the single-device models: process groups built once from
a layout, tensor/context/data parallelism for attention, expert parallelism for the MoE layers."""
