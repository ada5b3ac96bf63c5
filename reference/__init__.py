"""The lectures' reference implementations of what the labs ask students to write.

TP layers, SP layers, vocab-parallel ops, overlapped linears, pipeline schedules, the 3-D planner,
DTensor plans. Lectures import them; a grading rank and the autograded notebook never see them.
"""
