"""nbgrader's submit, its submission readable by the course's group only (the hub's `ExchangeFactory.submit`).

nbgrader 0.9.6 makes a submission in the exchange's inbound folder readable by everyone (files 0644, its folder
0777) and hides it only by a name no one can list (a timestamp and a random suffix). The inbound folder is setgid
to the instructor's group (nbgrader's own release makes it so), so what a student submits belongs to that group:
here the submission keeps the owner's and the group's bits only (files 0640, folders 2770), and another student
cannot read it even knowing its path, while the instructor's `nbgrader collect` still can.
"""
import os
import shutil

from nbgrader.exchange.default.submit import ExchangeSubmit


class PrivateSubmit(ExchangeSubmit):
    def do_copy(self, src, dest, log=None):
        # copytree would copy the student's folder's mode onto the submission's folder, and a chmod by someone
        # outside the group clears the setgid bit: what is written there next (timestamp.txt) would be the
        # student's group's, unreadable to the instructor. Folders keep the mode they were made with.
        real = shutil.copystat

        def copystat(s, d, *, follow_symlinks=True):
            if not os.path.isdir(d):
                real(s, d, follow_symlinks=follow_symlinks)
        shutil.copystat = copystat
        try:
            super().do_copy(src, dest, log)
        finally:
            shutil.copystat = real

    def set_perms(self, dest, fileperms, dirperms):
        super().set_perms(dest, fileperms & ~0o007, (dirperms & ~0o007) | 0o2070)

    def copy_files(self):
        super().copy_files()
        dest = os.path.join(self.inbound_path, self.assignment_filename)
        if os.path.isdir(dest):
            os.chmod(dest, 0o2770)
