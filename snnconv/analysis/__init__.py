"""What a conversion did and costs: activity while it runs (``activity``), the health checks
between stages, accuracy and agreement (``metrics``), energy, the HTML report, plots and the
one-line summary, and early exit (``early_exit``: calibrated and evaluated).
"""
