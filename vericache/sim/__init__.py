"""Evidence at the scale users run, without the hardware. An event core (events.py: a clock,
devices that run one forward at a time, links that move bytes) charges each forward what the cost
model says it takes (cost.py) on the named model and device (profiles.py: datasheets until
calibrated). Pure Python: no torch is needed to import or run it."""
