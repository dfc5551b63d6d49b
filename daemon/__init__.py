"""kvpilot.daemon"""
