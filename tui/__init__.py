"""The Textual dashboard (`blink-appliance top`). Installed as blink_appliance.tui."""
