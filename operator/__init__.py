"""kvpilot.operator"""
