"""Stage 5, compare (the parity stage): train engine and reference on the ranks and judge them quantity by
quantity within the tolerance policy; the knob checks on the communication trace, offload placement,
resume and stress.
"""
